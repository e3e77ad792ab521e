"""Lab measurements beside the harness (GPU only): ABBA A/B of two variants, where a prefill call's time goes,
power and clocks, and runs for a profiler. ``README.md`` says what each measures and how to run it."""
