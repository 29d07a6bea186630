"""The one exception family of spec-hal."""


class HalError(Exception):
    """Every error spec-hal raises on purpose.

    Argument errors carry ``arg``, ``expected`` and ``got`` and read
    ``"<arg>: expected <expected>, got <got>"``.
    """

    def __init__(self, message: str, *, arg: str | None = None, expected: str | None = None, got: str | None = None):
        super().__init__(message)
        self.arg, self.expected, self.got = arg, expected, got


def arg_error(arg: str, expected: str, got: object) -> HalError:
    """A `HalError` that names the argument, what was expected and what arrived."""
    return HalError(f"{arg}: expected {expected}, got {got}", arg=arg, expected=expected, got=str(got))
