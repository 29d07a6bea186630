"""Models: fetching and GGUF/safetensors loading, the tokenizer, the Llama-family runner
(batch-invariant by default, its linear layers on a plan measured per machine:
`linear_plan`), and the EAGLE head model with the heads shipped for it (`eagle`)."""
