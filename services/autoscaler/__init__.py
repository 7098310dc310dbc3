"""The autoscaler: sizes each model's pool from queue load (DESIGN.md, Autoscaling).

``services.autoscaler.control`` is the pure control law; the async shell that reads
gauges and actuates drivers wraps it.
"""
