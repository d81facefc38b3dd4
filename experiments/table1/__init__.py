"""The paper's Table 1: on the real MiniLM, converted and trained (`study`, its jobs in `conversion_jobs`,
``make table1``) and pretrained from scratch (`scratch`, its curve in `scratch_curve` and time estimate in
`scratch_budget`, ``make table1-scratch``); their arms (`arms`, `spec`, `scratch_spec`), data (`data`, `scratch_data`),
the job runner both use (`runner`), shared training and timing steps (`steps`), the P-alone control (`p_only`),
statistics (`stats`, `gaps`), budgets (`budget`) and reports (`report`, `scratch_report`)."""
