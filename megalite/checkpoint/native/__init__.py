"""megalite's own checkpoint format (the package docstring describes it): what a rank saves
and how it was cut, the global index, atomic and async saves, safetensors-layout files."""
