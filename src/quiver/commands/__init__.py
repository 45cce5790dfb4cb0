"""What the `quiver` commands do, as functions the CLI and the public API call: `check`, `demo`, `quantize`
and `eval`, context and section reports, accuracy reports."""
