"""The paper's Table 1: on the real MiniLM, converted and trained (`study`, ``make table1``) and pretrained from
scratch (`scratch`, ``make table1-scratch``); their arms (`spec`, `scratch_spec`), data (`data`, `scratch_data`),
shared training and timing steps (`steps`), statistics (`stats`, `gaps`), budgets (`budget`) and reports."""
