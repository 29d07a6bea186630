"""spec-hal's built-in backends. Each registers through the ``spec_hal`` entry
point group, exactly like a third-party plugin."""
