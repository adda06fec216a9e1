"""`otel-straggler report`: the HTML report built from a detector's evidence directory, and the
one-paragraph summary of a run that the report and the demo both print."""
