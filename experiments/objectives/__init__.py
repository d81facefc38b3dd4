"""``python -m experiments objectives`` (`make objectives`): paper vs shift-invariant vs Fisher selection
objectives, judged at the output (`study`; ``results/objectives``)."""
