"""The runtime's exception family."""


class OffloadError(Exception):
    """The runtime cannot do what was asked (budget too small, prompt too long, ...): says why and the fix."""


class NonFiniteLogits(OffloadError):
    """The model's output holds NaN or Inf: its weights, not the request, are at fault."""

    def __init__(self, position: int):
        self.position = position
        super().__init__(f"the logits at position {position} are not finite (NaN or Inf): a "
                         "weight tensor of the model is likely corrupt or stored as the wrong type")
