"""The bundled `evaluate` accuracy module (a package only so that wheels ship ``accuracy.py``)."""
