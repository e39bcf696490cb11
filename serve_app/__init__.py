"""The application: the graph built from one validated config, the `tensorfold` command, starting Ray and
Serve, benchmarks, fixtures and the embedded tiny-glm."""
