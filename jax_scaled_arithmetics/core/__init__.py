"""The core: ScaledArray, the autoscale interpreter, its rule registry and scale arithmetic."""
