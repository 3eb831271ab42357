"""The benchmark the product ships (`miniserve bench`, the Benchmark tab), llama.cpp as a peer,
and synthetic models in real shapes."""
