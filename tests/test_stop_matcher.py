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
