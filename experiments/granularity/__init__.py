"""One P and R vs per layer vs per head: at one length (`study`), with length buckets (`lengths`), recovered
(`recover`), layer by layer (`layers`) and refit without training (`refit`); ``results/granularity*``."""
