"""The study: the job x node-count matrix run through the schedulers, and the report on past runs
(throughput, epoch time, accuracy, scaling, energy) as tables, figures and pages.

Takes in: run records and collected results; jobs and an inventory for the matrix.
Gives out: study tables, report pages and figures.
Must never import: planner, lab or cli.
"""
