// tests/op_counter.hpp: the op recorder and the counting allocator that the tensor path's op
// counts (kvevict_bench --count-ops) rest on. Expected counts are worked out by hand from what
// each ATen call does (an output allocated or not, a view or a copy), the same on LibTorch
// 1.13 and 2.x.
#include "op_counter.hpp"

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <thread>

using kvevict_test::OpKind;
using kvevict_test::OpRecorder;

namespace {

struct Expected {
  int64_t kernels, views, noops, transfers, syncs, allocations;
};

void check_counts(const OpRecorder& rec, Expected e) {
  const auto c = rec.counts();
  CHECK(c.kernels == e.kernels);
  CHECK(c.views == e.views);
  CHECK(c.noops == e.noops);
  CHECK(c.transfers == e.transfers);
  CHECK(c.syncs == e.syncs);
  CHECK(c.allocations == e.allocations);
}

}  // namespace

TEST_CASE("OpRecorder: a kernel with a new output is one kernel and one allocation of its bytes", "[op_counter]") {
  const auto a = at::ones({2, 3}), b = at::ones({2, 3});
  OpRecorder rec;
  const auto c = a.add(b);
  check_counts(rec, {1, 0, 0, 0, 0, 1});
  CHECK(rec.counts().bytes == 2 * 3 * 4);
  REQUIRE(rec.events().size() == 1);
  const auto& e = rec.events()[0];
  CHECK(e.name == "aten::add");
  CHECK(e.kind == OpKind::kernel);
  CHECK_FALSE(e.syncs);
  CHECK(e.shapes == std::vector<std::vector<int64_t>>{{2, 3}, {2, 3}});
}

TEST_CASE("OpRecorder: in-place kernels of tensors allocate nothing; views launch nothing", "[op_counter]") {
  auto a = at::zeros({4, 6});
  const auto b = at::ones({4, 6}), c = at::ones({2, 6});
  OpRecorder rec;
  a.add_(b);                               // kernel
  auto v = a.narrow(0, 1, 2);              // view (narrow -> slice: one view)
  v.mul_(c);                               // kernel
  auto w = a.view({24}).select(0, 3);      // two views
  auto r = a.reshape({6, 4});              // reshape of a contiguous tensor: a view
  check_counts(rec, {2, 4, 0, 0, 0, 0});
  const auto views = rec.by_name(OpKind::view);
  REQUIRE(views.size() == 4);
  CHECK(views[0].first == "aten::narrow");
  CHECK(views[3].first == "aten::reshape");
  CHECK(rec.events()[1].ints == std::vector<int64_t>{0, 1, 2});  // narrow(dim 0, start 1, length 2)
}

TEST_CASE("OpRecorder: an op counts once at the outermost op that is not a view or allocation", "[op_counter]") {
  const auto a = at::ones({3, 5});
  OpRecorder rec;
  const auto z = at::zeros({7});                  // empty + zero_ inside: one kernel, one allocation
  const auto c = a.t().contiguous();              // t: a view; contiguous copies: one kernel (clone)
  const auto same = a.contiguous();               // already contiguous: not even dispatched
  const auto e = at::empty({5});                  // an allocation, no kernel
  check_counts(rec, {2, 1, 0, 0, 0, 3});
  const auto kernels = rec.by_name(OpKind::kernel);
  REQUIRE(kernels.size() == 2);
  CHECK(kernels[0].first == "aten::zeros");
  CHECK(kernels[1].first == "aten::clone");
  REQUIRE(rec.by_name(OpKind::allocation).size() == 1);
  CHECK(rec.by_name(OpKind::allocation)[0].first == "aten::empty");
}

TEST_CASE("OpRecorder: to() naming a device is a transfer, to() of a dtype a kernel", "[op_counter]") {
  const auto a = at::ones({4}, at::kDouble);
  OpRecorder rec;
  const auto up = a.to(at::kCPU);                                         // transfer (aliases on CPU)
  const auto copied = a.to(at::Device(at::kCPU), at::kDouble, false, true);  // transfer with a copy
  const auto f = a.to(at::kFloat);                                        // a cast: kernel
  const auto same = a.to(at::kDouble);                                    // returns a itself: a no-op
  check_counts(rec, {1, 0, 1, 2, 0, 2});
  CHECK(rec.events()[0].kind == OpKind::transfer);
  CHECK(rec.events()[0].syncs);
}

TEST_CASE("OpRecorder: item() is a sync; nonzero is a kernel that syncs; nested syncs count", "[op_counter]") {
  const auto a = at::arange(6, at::kFloat);
  OpRecorder rec;
  const float s = a.sum().item<float>();               // kernel (sum) + sync (item)
  const auto nz = a.gt(2).nonzero();                   // kernel (gt) + kernel that syncs (nonzero)
  const auto picked = a.index({a.gt(2)});              // kernel (gt) + kernel (index) with a nonzero inside
  CHECK(s == 15.f);
  CHECK(nz.size(0) == 3);
  CHECK(picked.size(0) == 3);
  const auto c = rec.counts();
  CHECK(c.kernels == 5);
  CHECK(c.views == 0);
  CHECK(c.transfers == 0);
  CHECK(c.syncs == 3);
  const auto syncs = rec.by_name(OpKind::sync);
  REQUIRE(syncs.size() == 2);
  CHECK(syncs[0].first == "aten::item");
  CHECK(syncs[1].first == "aten::nonzero");  // inside aten::index
}

TEST_CASE("OpRecorder: ops of other threads are not counted; allocations of every thread are", "[op_counter]") {
  OpRecorder rec;
  std::thread([] { at::ones({8}); }).join();  // one allocation
  check_counts(rec, {0, 0, 0, 0, 0, 1});
  CHECK(rec.events().empty());
}

TEST_CASE("OpRecorder: the same ops on the same shapes record equal events; other shapes do not", "[op_counter]") {
  auto step = [](int64_t n) {
    OpRecorder rec;
    at::ones({n}).narrow(0, 0, 2).mul_(3);
    return rec.events();
  };
  const auto first = step(4), second = step(4), other = step(5);
  REQUIRE(first.size() == 3);  // ones (kernel), narrow (view), mul_ (kernel)
  CHECK(first == second);
  CHECK(first != other);
  CHECK(first[0].ints == std::vector<int64_t>{4});
}

TEST_CASE("CountingCpuAllocator: counts requests of at least min_bytes; OpRecorder leaves out empty ones",
          "[op_counter]") {
  kvevict_test::CountingCpuAllocator all, large(64);
  OpRecorder rec;
  const auto empty = at::empty({0});  // a 0-byte request: allocates nothing
  const auto small = at::empty({4});  // 16 bytes
  const auto big = at::empty({32});   // 128 bytes
  CHECK(all.count() == 3);
  CHECK(all.bytes() == 16 + 128);
  CHECK(large.count() == 1);
  CHECK(large.bytes() == 128);
  CHECK(rec.counts().allocations == 2);
  CHECK(rec.counts().bytes == 16 + 128);
}

TEST_CASE("OpRecorder: one recorder at a time", "[op_counter]") {
  OpRecorder rec;
  CHECK_THROWS_AS(OpRecorder(), std::logic_error);
}
