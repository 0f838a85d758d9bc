"""Shape buckets: the padded sizes that keep the number of compiled program variants small."""


def pow2_bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum) (minimum itself when it is larger)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pow2_buckets_up_to(n: int) -> list[int]:
  """Every bucket of a count in [1, n]: 1, 2, 4, ... up to pow2_bucket(n)."""
  return [1 << i for i in range(pow2_bucket(n).bit_length())]


ROW_STEP = 8  # past this many rows, a model call's rows pad to multiples of a step


def row_bucket(n: int) -> int:
  """Rows of a model call: a power of two up to ROW_STEP, then a multiple of
  max(ROW_STEP, pow2_bucket(n) / ROW_STEP).

  Every padded row costs its share of each weight matmul, so past ROW_STEP rows the padding stays
  under ROW_STEP rows or 1/8 of the call (instead of up to half of it with powers of two), while
  the number of buckets grows only by ROW_STEP per doubling."""
  if n <= ROW_STEP:
    return pow2_bucket(n)
  step = max(ROW_STEP, pow2_bucket(n) // ROW_STEP)
  return -(-n // step) * step


def row_buckets_up_to(n: int) -> list[int]:
  """Every row bucket of a count in [1, n], ascending."""
  return sorted({row_bucket(i) for i in range(1, max(n, 1) + 1)})
