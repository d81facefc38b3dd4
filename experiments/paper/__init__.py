"""``python -m experiments paper`` (`make paper`): the analysis at the paper's scale, whole matrix at n = 128
(`study`; ``results/paper``)."""
