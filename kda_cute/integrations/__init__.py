"""Ways in from other libraries: `kda_cute.integrations.fla` (an fla backend)."""
