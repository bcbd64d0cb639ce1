"""The Lightning strategies (Trainer and Fabric) and what they share: wiring, the runtime, checkpoints,
replica checks, the sharded engine, emulated workers, presets.
"""
