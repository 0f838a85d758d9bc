"""Shape buckets: the padded sizes that keep the number of compiled program variants small."""


def pow2_bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum) (minimum itself when it is larger)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def pow2_buckets_up_to(n: int) -> list[int]:
  """Every bucket of a count in [1, n]: 1, 2, 4, ... up to pow2_bucket(n)."""
  return [1 << i for i in range(pow2_bucket(n).bit_length())]
