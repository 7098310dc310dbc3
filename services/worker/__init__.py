"""The worker service: owns one inference engine and speaks the mesh protocol for it."""
