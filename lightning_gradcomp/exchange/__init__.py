"""The exchange every engine runs: the hook, its groups and router, the transports, the ledger, the guard,
the residuals, the planner and its cost model, the codec measurement.
"""
