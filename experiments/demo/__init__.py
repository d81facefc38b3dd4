"""``python -m experiments demo`` (`make demo`): the whole analysis on the real MiniLM and pydoc text (`study`)."""
