"""tokpipe.data.blocks: the order a store can serve, checked against its rules written out here: every window once an
epoch, a buffer's windows those of its blocks, the blocks in a seeded order per epoch, and the geometry a cache
size gives."""

import numpy as np

from tokpipe.data import Permutation
from tokpipe.data.blocks import BlockOrder, Geometry
from tokpipe.data.permutation import epoch_seed


def test_an_epoch_takes_every_window_once_a_buffer_of_blocks_at_a_time():
    geometry = Geometry(windows=1000, per_block=7, buffer=5)  # 143 blocks, the last of 6 windows
    assert geometry.blocks == 143 and geometry.counts()[-1] == 6 and geometry.counts().sum() == 1000
    order = BlockOrder(geometry, seed=3)
    for epoch in range(3):
        windows = order.windows(epoch, np.arange(1000))
        assert sorted(windows.tolist()) == list(range(1000))
        blocks = Permutation(143, epoch_seed(3, epoch))[np.arange(143)]  # the epoch's blocks, in order
        position = 0
        for j in range(29):  # 28 buffers of 5 blocks and one of 3
            in_buffer = blocks[5 * j : 5 * j + 5]
            assert np.array_equal(order.blocks_of(epoch, j), in_buffer)
            n = int(geometry.counts()[in_buffer].sum())
            assert order.positions_of(epoch, j) == (position, position + n)
            taken = windows[position : position + n]
            assert sorted(taken.tolist()) == sorted(
                w for b in in_buffer.tolist() for w in range(7 * b, 7 * b + 7) if w < 1000
            )
            assert order.buffer_of(epoch, position) == order.buffer_of(epoch, position + n - 1) == j
            position += n
        assert order.after(epoch, 27) == (epoch, 28) and order.after(epoch, 28) == (epoch + 1, 0)
    assert not np.array_equal(order.windows(0, np.arange(1000)), order.windows(1, np.arange(1000)))
    assert np.array_equal(order.windows(1, np.arange(1000)), BlockOrder(geometry, 3).windows(1, np.arange(1000)))


def test_positions_anywhere_in_an_epoch_give_the_windows_of_the_whole_order_there():
    order = BlockOrder(Geometry(windows=5000, per_block=16, buffer=4), seed=11)
    whole = order.windows(2, np.arange(5000))
    picked = np.array([4999, 0, 17, 2500, 63, 64, 1234])  # in any buffers, any order
    assert np.array_equal(order.windows(2, picked), whole[picked])


def test_a_cache_size_gives_blocks_of_a_quarter_of_it_at_most_16_mib_and_a_buffer_of_half():
    # 8 MiB, seq_len 256 of uint32: blocks of 2 MiB (2,048 windows of 1 KiB), 2 a buffer
    assert Geometry.fitted(33_230, 256, 4, 8 << 20) == Geometry(33_230, 2048, 2)
    # 4 GiB: blocks of 16 MiB (MAX_BLOCK), 128 a buffer
    assert Geometry.fitted(10**9, 2048, 4, 4 << 30) == Geometry(10**9, 2048, 128)
    # a cache smaller than a window still holds a block of one window, a buffer of one block
    assert Geometry.fitted(100, 2048, 4, 1000) == Geometry(100, 1, 1)
