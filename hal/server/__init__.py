"""The OpenAI-compatible HTTP server (`app`, ``spec-hal serve``): request bodies and
responses in OpenAI's wire format (`openai_schema`) and live Prometheus metrics (`live_metrics`)."""
