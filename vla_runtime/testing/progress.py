"""A :data:`~vla_runtime.progress.Progress` that records what each bar was told, for tests.

The commands report their steps through progress bars, not log lines; a test that checks the
order of the steps (the modes taking turns, say) reads the bars' postfixes here instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecordedBar:
    desc: str
    total: int | None
    count: int = 0
    postfixes: list[str] = field(default_factory=list)
    closed: bool = False

    def update(self, n: int = 1) -> None:
        self.count += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfixes.append(s)

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> "RecordedBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RecordingBars:
    bars: list[RecordedBar] = field(default_factory=list)

    def __call__(self, desc: str, total: int | None, unit: str = "it") -> RecordedBar:
        self.bars.append(RecordedBar(desc, total))
        return self.bars[-1]

    @property
    def postfixes(self) -> dict[str, list[str]]:
        """Every postfix set, by bar description (bars of one description concatenated)."""
        out: dict[str, list[str]] = {}
        for b in self.bars:
            out.setdefault(b.desc, []).extend(b.postfixes)
        return out
