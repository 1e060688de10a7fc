// libFuzzer target for the safetensors reader (see fuzz/README.md).
//
// Beyond "does not crash", it checks the reader's contract on every accepted input:
//   - every tensor's bytes lie inside the input, and reading all of them is safe (ASan);
//   - get() with the tensor's own dtype and shape succeeds;
//   - writing the parsed tensors back and parsing the result gives the same tensors, so the
//     reader accepts nothing the writer cannot reproduce.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>

#include "formats/safetensors.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors: property violated: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moebius;
  auto f = SafetensorsFile::parse({data, size}, "fuzz.safetensors");
  if (!f.ok()) {
    if (f.error().what().empty()) fail("empty error message");
    return 0;
  }

  volatile uint8_t sink = 0;
  for (const TensorInfo& t : f->tensors()) {
    if (t.data < data || t.data + t.nbytes() > data + size) fail("tensor bytes outside the input");
    for (uint8_t b : t.bytes()) sink = sink ^ b;  // reads every byte: ASan catches any overrun
    if (!f->get(t.name, t.dtype, t.shape).ok()) fail("get() refused a tensor with its own dtype/shape");
    if (f->find(t.name) != &t) fail("find() does not return the tensor");
  }

  SafetensorsWriter w;
  for (const TensorInfo& t : f->tensors())
    if (!w.add_borrowed(t.name, t.dtype, t.shape, t.bytes()).ok()) fail("writer refused a parsed tensor");
  for (const auto& [k, v] : f->metadata())
    if (!w.set_metadata(k, v).ok()) fail("writer refused parsed metadata");
  auto bytes = w.serialize();
  if (!bytes.ok()) fail("serialize failed");
  auto again = SafetensorsFile::parse(*bytes, "rewritten");
  if (!again.ok()) fail("reader refused the writer's output");
  if (again->size() != f->size() || again->metadata() != f->metadata()) fail("round trip changed the file");
  for (size_t i = 0; i < f->size(); ++i) {
    const TensorInfo& a = f->tensors()[i];
    const TensorInfo& b = again->tensors()[i];
    if (a.name != b.name || a.dtype != b.dtype || !(a.shape == b.shape) || a.nbytes() != b.nbytes())
      fail("round trip changed a tensor");
    for (size_t k = 0; k < a.nbytes(); ++k)
      if (a.data[k] != b.data[k]) fail("round trip changed tensor bytes");
  }
  return 0;
}
