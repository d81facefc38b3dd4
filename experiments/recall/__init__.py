"""What R earns, decided on tasks where attention matters (issue 53): ``python -m experiments recall`` (``make
recall``). Small encoders trained from scratch per task (`tasks`) and arm (`spec`) through the project's own model
classes and trainer (`study`, `run`), reported with every rule it applies (`report`) in ``results/recall/``."""
