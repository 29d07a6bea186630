"""Model side of spec-hal: fetching, GGUF/safetensors loading, the tokenizer and a
compact Llama-family runner whose attention goes through the backend's ops."""
