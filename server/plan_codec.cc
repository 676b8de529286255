#include "server/plan_codec.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace ckptd {
namespace {

void ToMsg(const ckpt::Box& b, peer::v1::BoxMsg* m) {
  for (int64_t d : b.offset) m->add_offset(d);
  for (int64_t d : b.shape) m->add_shape(d);
}

ckpt::Box FromMsg(const peer::v1::BoxMsg& m) {
  return ckpt::Box{ckpt::Shape(m.offset().begin(), m.offset().end()),
                   ckpt::Shape(m.shape().begin(), m.shape().end())};
}

}  // namespace

void ToMsg(const ckpt::TargetTensor& t, peer::v1::TargetMsg* m) {
  m->set_name(t.name);
  m->set_dtype(std::string(ckpt::DTypeName(t.dtype)));
  for (int64_t d : t.global_shape) m->add_global_shape(d);
  ToMsg(t.box, m->mutable_box());
  if (t.flat_range) {
    m->mutable_flat_range()->set_begin(t.flat_range->begin);
    m->mutable_flat_range()->set_end(t.flat_range->end);
  }
}

absl::StatusOr<ckpt::TargetTensor> FromMsg(const peer::v1::TargetMsg& m) {
  ckpt::TargetTensor t;
  t.name = m.name();
  CKPT_ASSIGN_OR_RETURN(t.dtype, ckpt::ParseDType(m.dtype()));
  t.global_shape.assign(m.global_shape().begin(), m.global_shape().end());
  t.box = FromMsg(m.box());
  if (m.has_flat_range()) t.flat_range = ckpt::FlatRange{m.flat_range().begin(), m.flat_range().end()};
  return t;
}

void ToMsg(const ckpt::RankPlan& r, peer::v1::RankPlanMsg* m) {
  m->set_rank(r.rank);
  for (const auto& t : r.targets) ToMsg(t, m->add_targets());
  for (const ckpt::CopyOp& c : r.copies) {
    peer::v1::CopyMsg* cm = m->add_copies();
    cm->set_target(c.target);
    cm->set_read(c.read);
    ToMsg(c.src.box, cm->mutable_src()->mutable_box());
    cm->mutable_src()->set_flat_begin(c.src.flat_begin);
    cm->mutable_src()->set_flat_end(c.src.flat_end);
    cm->mutable_src()->set_dtype(std::string(ckpt::DTypeName(c.src.dtype)));
    for (int a : c.src.perm) cm->mutable_src()->add_perm(a);
    cm->set_src_offset(c.src_offset);
    ToMsg(c.region, cm->mutable_region());
    cm->set_elements(c.elements);
  }
  for (const auto& k : r.missing_keys) m->add_missing_keys(k);
  m->set_local_fast_path(r.local_fast_path);
}

absl::StatusOr<ckpt::RankPlan> FromMsg(const peer::v1::RankPlanMsg& m) {
  ckpt::RankPlan r;
  r.rank = m.rank();
  for (const auto& t : m.targets()) {
    CKPT_ASSIGN_OR_RETURN(ckpt::TargetTensor tt, FromMsg(t));
    r.targets.push_back(std::move(tt));
  }
  for (const auto& cm : m.copies()) {
    ckpt::CopyOp c;
    c.target = cm.target();
    c.read = cm.read();
    c.src.box = FromMsg(cm.src().box());
    c.src.flat_begin = cm.src().flat_begin();
    c.src.flat_end = cm.src().flat_end();
    CKPT_ASSIGN_OR_RETURN(c.src.dtype, ckpt::ParseDType(cm.src().dtype()));
    c.src.perm.assign(cm.src().perm().begin(), cm.src().perm().end());
    if (!c.src.perm.empty()) {
      // A permutation of the box's axes, or the copy could index anywhere.
      std::vector<bool> seen(c.src.box.rank(), false);
      bool ok = c.src.perm.size() == c.src.box.rank();
      for (int a : c.src.perm) {
        ok = ok && a >= 0 && static_cast<size_t>(a) < seen.size() && !seen[a];
        if (ok) seen[a] = true;
      }
      if (!ok) {
        return absl::DataLossError(absl::StrCat("plan part: copy of rank ", r.rank,
                                                " has an invalid axis permutation"));
      }
    }
    c.src_offset = cm.src_offset();
    c.region = FromMsg(cm.region());
    c.elements = cm.elements();
    if (c.target >= r.targets.size()) {
      return absl::DataLossError(absl::StrCat("plan part: copy of rank ", r.rank,
                                              " names target ", c.target, " of ", r.targets.size()));
    }
    r.copies.push_back(std::move(c));
  }
  r.missing_keys.assign(m.missing_keys().begin(), m.missing_keys().end());
  r.local_fast_path = m.local_fast_path();
  return r;
}

void ToMsg(const ckpt::ReadRange& r, peer::v1::ReadMsg* m) {
  m->set_file(r.file);
  m->set_offset(r.offset);
  m->set_length(r.length);
  for (const auto& c : r.checks) {
    peer::v1::CheckMsg* cm = m->add_checks();
    cm->set_tensor(c.tensor);
    cm->set_offset(c.offset);
    cm->set_nbytes(c.nbytes);
    cm->set_xxh3(c.xxh3);
  }
}

ckpt::ReadRange FromMsg(const peer::v1::ReadMsg& m) {
  ckpt::ReadRange r;
  r.file = m.file();
  r.offset = m.offset();
  r.length = m.length();
  for (const auto& c : m.checks()) r.checks.push_back({c.tensor(), c.offset(), c.nbytes(), c.xxh3()});
  return r;
}

}  // namespace ckptd
