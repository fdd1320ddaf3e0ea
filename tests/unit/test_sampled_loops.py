"""The simulator's counting shortcut through tile loops (`upipe.planner.sampled.repeated_tiles`)
counts what the whole loop does, whole tiles and a partial last one alike."""

from __future__ import annotations

from upipe import loops
from upipe.planner.sampled import repeated_tiles


class _Tally:
    """The counting side: one count, marked and repeated as `repeated_tiles` asks."""

    def __init__(self):
        self.count, self.runs = 0, 0

    def mark(self) -> int:
        return self.count

    def repeat(self, mark: int, times: int) -> None:
        self.count += (self.count - mark) * times


def test_repeated_tiles_count_every_tile():
    """Each iteration counts its tile's tokens: the total is every token of the loop, for
    every length and tile size, from at most three iterations run."""
    for tile in range(1, 13):
        for length in range(1, 100):
            tally = _Tally()
            with repeated_tiles(tally):
                for s in loops.tile_starts(length, tile):
                    tally.count += min(tile, length - s)
                    tally.runs += 1
            assert tally.count == length, (length, tile)
            assert tally.runs == min(len(range(0, length, tile)), 3 if length % tile else 2)
    assert list(loops.tile_starts(85, 10)) == list(range(0, 85, 10))  # restored on exit
