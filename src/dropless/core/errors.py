"""The one error type of the MoE package."""


class MoEError(ValueError):
    """A user-facing mistake at the MoE layer's boundary (a shape or backend mismatch); one sentence with the fix."""
