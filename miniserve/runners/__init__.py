"""Forward passes behind one protocol (base.Runner): transformers (hf), PyTorch (lean), the
compiled many-row pass (native, kernels/), a GGUF's weights as stored (stored, gguf_file);
loading a model (loader) and the bounds each runner keeps to float64 (verify).
Imports only core."""
