"""What runs beside training: collective monitoring and timeouts, straggler detection, profiling,
metrics and experiment tracking, and what the host CPU computes fast."""
