// engine/backends/cuda/products/qgemm.py: _QW
// one m-tile's weight registers for one k-step: words of its two rows, scale/bias pairs

struct MbQw {
  uint4 q0, q1;
  uint32_t sc0, sc1, bi0, bi1;
};
