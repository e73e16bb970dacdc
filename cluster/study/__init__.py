"""Stage 5, the study: bench, placement and communication model, the job x node-count matrix, the report.

Takes in: run records and collected results, bench measurements.
Gives out: plans (which nodes, which shares), study tables, report pages and figures.
Must never import: lab or cli.
"""
