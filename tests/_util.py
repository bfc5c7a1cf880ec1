"""Small helpers shared by the tests (imported as a top-level module: tests/ is on sys.path)."""
import torch


def snapshot(*tensors):
    """Copies of tensors, to prove later that a call left its inputs untouched."""
    return [t.clone() for t in tensors]


def assert_unchanged(before, after):
    for b, a in zip(before, after):
        assert torch.equal(b, a), "an input tensor was modified"


class ModeRecorder:
    """Records the mode of every ``sage_diffusers.attention`` call, in order (through monkeypatch)."""

    def __init__(self, monkeypatch):
        import sage_diffusers
        from sage_diffusers.options import Mode

        self.modes: list = []
        original = sage_diffusers.attention

        def spy(*args, **kwargs):
            self.modes.append(Mode.parse(kwargs["mode"]))
            return original(*args, **kwargs)

        monkeypatch.setattr(sage_diffusers, "attention", spy)

    def take(self) -> list:
        """The modes recorded since the last take."""
        modes, self.modes = self.modes, []
        return modes
