"""Shape buckets: the padded sizes that keep the number of compiled program variants small."""


def pow2_bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum) (minimum itself when it is larger)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pow2_buckets_up_to(n: int) -> list[int]:
  """Every bucket of a count in [1, n]: 1, 2, 4, ... up to pow2_bucket(n)."""
  return [1 << i for i in range(pow2_bucket(n).bit_length())]


ROW_STEP = 8  # past this many rows, a call's rows pad to a power of two or 1.5 times one


def row_bucket(n: int) -> int:
  """Rows of a model call: a power of two up to ROW_STEP, then the smallest of 16, 24, 32, 48,
  64, 96, ... (powers of two and 1.5 times them) that holds n.

  Every padded row costs its share of each weight matmul, so past ROW_STEP rows the padding
  stays under a third of the call (instead of up to half of it with powers of two), while the
  buckets grow by two per doubling: 9 row counts up to 64."""
  if n <= 2 * ROW_STEP:
    return pow2_bucket(n)
  p = pow2_bucket(n)
  return p * 3 // 4 if n <= p * 3 // 4 else p


def row_buckets_up_to(n: int) -> list[int]:
  """Every row bucket of a count in [1, n], ascending."""
  return sorted({row_bucket(i) for i in range(1, max(n, 1) + 1)})

