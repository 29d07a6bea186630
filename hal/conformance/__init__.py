"""The spec-hal conformance suite: a pytest plugin plus test modules.

Run it against any registered backend::

    python -m hal conformance --backend NAME
    pytest --pyargs hal.conformance --hal-backend NAME

Every test is written once and parametrised over the backends named by
``--hal-backend`` (comma separated; default: every available backend). The
oracle is `verify_ops`, the reference implementation.
"""
