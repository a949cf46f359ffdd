// Staging host CSR arrays bound for a CUDA device (stage_csr): the indices copied into pinned
// memory and checked there, large arrays over several threads (across_threads, copy_checked),
// then sent to the device; a staged pattern is young (young.h).
//
// Part of csrc/fastpath.cpp, the library's one translation unit, which includes it after
// host_probes.h: it uses names the parts before it declare and is not compiled on its own.

#pragma once

namespace {

// fn(begin, end) over [0, total): in one call where total is below 2 * grain, else in chunks of
// at least `grain` on the calling thread and torch's inter-op pool, returning once all are done.
// (at::parallel_for would run serially here: its OpenMP pragmas are compiled into this library,
// which is built without -fopenmp.) fn must not throw. Returns the chunks' length (the last may
// be shorter): chunk c is [c * length, (c + 1) * length).
template <typename F>
int64_t across_threads(int64_t total, int64_t grain, const F& fn) {
  const int64_t chunks =
      std::min<int64_t>(total / grain, std::max<int64_t>(1, static_cast<int64_t>(at::get_num_interop_threads())));
  if (chunks < 2) {
    fn(0, total);
    return std::max<int64_t>(total, 1);
  }
  const int64_t length = (total + chunks - 1) / chunks;
  int64_t pending = chunks - 1;  // under `mutex`: the last task touches nothing of this frame after it
  std::mutex mutex;
  std::condition_variable finished;
  for (int64_t c = 1; c < chunks; ++c)
    at::launch([&, c] {
      fn(c * length, std::min(total, (c + 1) * length));
      std::lock_guard<std::mutex> lock(mutex);
      if (--pending == 0) finished.notify_one();
    });
  fn(0, length);
  std::unique_lock<std::mutex> lock(mutex);
  finished.wait(lock, [&] { return pending == 0; });
  return length;
}

// Copies a host CSR's indices into `out` (crow at 0, col at `offset`) and checks the copy: row
// pointers from 0 to nnz without a decrease, columns in [0, ncols). The check reads the copy, so
// what passed is what travels, whatever the caller writes meanwhile. Blocks of `block` elements
// are copied, then checked while they are in cache (one pass over main memory, as a plain copy
// makes); large arrays are split over threads (across_threads), and the row pairs that straddle
// two blocks are checked once every block is copied. The loops carry no dependency from one
// element to the next, so the compiler vectorizes them.
template <typename I>
bool copy_checked(const I* crow, const I* col, I* out, int64_t rows, int64_t nnz, int64_t offset, int64_t ncols) {
  using U = std::make_unsigned_t<I>;
  constexpr int64_t block = 8192, grain = int64_t{1} << 17;  // elements; below 2 * grain, one thread
  const U limit = static_cast<U>(ncols);  // ncols fits I: the caller refuses int32 indices past 2^31 - 1
  std::atomic<bool> bad{false};
  const int64_t length = across_threads(offset + nnz, grain, [&](int64_t begin, int64_t end) {
    I decreases = 0;
    U outside = 0;  // a negative column is a large unsigned one
    for (int64_t first = begin; first < end; first += block) {
      const int64_t last = std::min(end, first + block), split = std::clamp(offset, first, last);
      if (split > first) {  // [first, split): row pointers, and the pairs inside the block
        std::memcpy(out + first, crow + first, static_cast<size_t>(split - first) * sizeof(I));
        for (int64_t i = first; i + 1 < split; ++i) decreases |= static_cast<I>(out[i + 1] < out[i]);
      }
      if (last > split) {  // [split, last): columns
        std::memcpy(out + split, col + (split - offset), static_cast<size_t>(last - split) * sizeof(I));
        for (int64_t k = split; k < last; ++k) outside |= static_cast<U>(static_cast<U>(out[k]) >= limit);
      }
    }
    if (decreases != 0 || outside != 0) bad.store(true, std::memory_order_relaxed);
  });
  bool ok = !bad.load() && out[0] == 0 && static_cast<int64_t>(out[rows]) == nnz;
  // the pairs (first - 1, first) of every block starting inside the row pointers
  for (int64_t start = 0; ok && start <= rows; start += length)
    for (int64_t first = start; ok && first < std::min(start + length, rows + 1); first += block)
      if (first > 0) ok = out[first] >= out[first - 1];
  return ok;
}

// Host CSR arrays bound for a CUDA device (ts.csr of a sampled mini-batch): every check of
// ts.csr's Python path on its metadata (dims, dtypes, lengths against the shape, int32 bounds),
// the indices copied into one pinned buffer and checked there (copy_checked), then sent to two
// device tensors of their own (views of one buffer would alias: AOTAutograd hands aliased graph
// inputs over as views it makes, which the pattern cache does not know). The values, when given,
// are copied to pinned memory and sent the same way: no later write to the caller's arrays
// reaches the device. Nothing (an empty list) where this does not apply or a check fails: the
// caller's Python path then converts, copies, checks and names what is wrong. young_ns > 0: the
// pattern is young for that long (remember_young).
std::vector<at::Tensor> stage_csr(const at::Tensor& crow_in, const at::Tensor& col_in,
                                  const std::optional<at::Tensor>& val_in, int64_t nrows, int64_t ncols,
                                  at::Device device, int64_t young_ns) {
  const auto index = crow_in.scalar_type();
  if (!device.is_cuda() || !crow_in.device().is_cpu() || !col_in.device().is_cpu() || crow_in.dim() != 1 ||
      col_in.dim() != 1 || col_in.scalar_type() != index || (index != at::kInt && index != at::kLong) ||
      nrows < 0 || ncols < 0 || crow_in.size(0) != nrows + 1 || crow_in.requires_grad() || col_in.requires_grad() ||
      crow_in.is_inference() || col_in.is_inference())
    return {};
  const int64_t nnz = col_in.size(0), int32_max = std::numeric_limits<int32_t>::max();
  if (index == at::kInt && (nrows > int32_max || ncols > int32_max || nnz > int32_max)) return {};
  if (val_in && (!val_in->device().is_cpu() || val_in->dim() != 1 || val_in->size(0) != nnz ||
                 val_in->requires_grad() || !at::isFloatingType(val_in->scalar_type())))
    return {};
  const at::Tensor crow = crow_in.contiguous(), col = col_in.contiguous();  // a copy only where strided
  const int64_t offset = nrows + 1;
  at::Tensor staged = at::empty({offset + nnz}, crow.options().pinned_memory(true));
  const bool ok = index == at::kInt
                      ? copy_checked(crow.data_ptr<int32_t>(), col.data_ptr<int32_t>(), staged.data_ptr<int32_t>(),
                                     nrows, nnz, offset, ncols)
                      : copy_checked(crow.data_ptr<int64_t>(), col.data_ptr<int64_t>(), staged.data_ptr<int64_t>(),
                                     nrows, nnz, offset, ncols);
  if (!ok) return {};
  at::Tensor crow_out = at::empty({offset}, crow.options().device(device));
  at::Tensor col_out = at::empty({nnz}, col.options().device(device));
  // torch's host allocator keeps `staged` until both copies are done
  crow_out.copy_(staged.narrow(0, 0, offset), /*non_blocking=*/true);
  col_out.copy_(staged.narrow(0, offset, nnz), /*non_blocking=*/true);
  std::vector<at::Tensor> out{crow_out, col_out};
  // young: served by cuSPARSE from here for young_ns (the runtime's admission age), unless it has
  // more nonzeros than positions (cuSPARSE refuses those; Python multiplies their dense form)
  if (young_ns > 0 && static_cast<__int128>(nnz) <= static_cast<__int128>(nrows) * ncols)
    remember_young(crow_out, col_out, ncols, young_ns);
  if (val_in) {
    at::Tensor values = at::empty({nnz}, val_in->options().pinned_memory(true));
    values.copy_(*val_in);
    at::Tensor moved = at::empty({nnz}, values.options().device(device));
    moved.copy_(values, /*non_blocking=*/true);
    out.push_back(moved);
  }
  return out;
}

}  // namespace
