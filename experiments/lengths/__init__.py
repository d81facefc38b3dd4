"""Length buckets on inputs of real lengths (`study`, its report `report`; ``make lengths``, ``results/lengths``)
and a bucketed model recovered by distillation (`recover`; ``make recover``, ``results/recovery``)."""
