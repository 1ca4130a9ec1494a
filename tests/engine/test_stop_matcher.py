"""Stop strings are cut exactly, also when split across tokens."""

from engine.sequence import StopMatcher


def feed_all(matcher, pieces):
    out, matched = "", False
    for p in pieces:
        text, matched = matcher.feed(p)
        out += text
        if matched:
            break
    if not matched:
        out += matcher.flush()
    return out, matched


def test_stop_inside_one_piece():
    assert feed_all(StopMatcher(("END",)), ["hello END world"]) == ("hello ", True)


def test_stop_across_pieces_never_leaks_a_prefix():
    m = StopMatcher(("\n\nUser:",))
    emitted = []
    for p in ["Paris.", "\n", "\nUs", "er:", " more"]:
        text, matched = m.feed(p)
        emitted.append(text)
        if matched:
            break
    assert "".join(emitted) == "Paris."
    assert matched
    assert all("\n" not in e for e in emitted)


def test_false_start_is_released():
    assert feed_all(StopMatcher(("abc",)), ["xa", "b", "d"]) == ("xabd", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(StopMatcher(("world", "lo")), ["hello world"]) == ("hel", True)


def test_no_stops_passes_through():
    m = StopMatcher(())
    assert m.feed("anything") == ("anything", False)


class ReferenceMatcher:
    """A plain StopMatcher that tries every tail length: the reference."""

    def __init__(self, stops):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text):
        if not self.stops:
            return text, False
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        if self.hold == 0:
            out, self.pending = self.pending, ""
            return out, False
        keep = 0
        for k in range(min(self.hold, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self):
        out, self.pending = self.pending, ""
        return out


def test_same_as_trying_every_tail():
    """Random stop strings over a small alphabet (overlaps, repeats, one-character
    stops, shared first characters) and random pieces: every feed and flush agrees."""
    import random

    rng = random.Random(0)
    alphabet = "ab\nU:é🙂 "
    for _ in range(3000):
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            for _ in range(rng.randint(0, 4))
        )
        fast, ref = StopMatcher(stops), ReferenceMatcher(stops)
        for _ in range(rng.randint(1, 12)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
            got, want = fast.feed(piece), ref.feed(piece)
            assert got == want, (stops, piece)
            assert fast.pending == ref.pending
            if got[1]:
                break
        assert fast.flush() == ref.flush()
