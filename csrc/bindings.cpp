// pybind11 module gdn_packed._C. No libtorch: the Python side (gdn_packed/cuda/) passes raw pointers
// (Python ints, None for "no tensor"), sizes and, for a device launch, `device` and the cudaStream_t of
// torch's current stream.
//
// Every kernel entry point takes keyword arguments only, from a declared list (ARGS below): an
// unknown name, a missing one, a positional argument or a value of the wrong type is a TypeError that
// names it, before anything runs. Optional pointers are passed explicitly (None -> null); a required
// pointer (`ptr` below) that is null while the kernel would touch it is a ValueError that names it,
// also before anything runs. A kernel's Status maps to one exception: kInvalidValue -> ValueError,
// kCudaError -> RuntimeError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "api.h"

namespace py = pybind11;

#ifndef GDN_CUDA_ARCHS
#define GDN_CUDA_ARCHS "unknown"
#endif
#ifndef GDN_SM90_WATCHDOG_SPINS   // CMakeLists.txt: the spin count of a watchdog build (GDN_PACKED_SM90_WATCHDOG)
#define GDN_SM90_WATCHDOG_SPINS 0
#endif

namespace {

void raise_if(const gdn::Status& s) {
  switch (s.kind) {
    case gdn::StatusKind::kOk: return;
    case gdn::StatusKind::kInvalidValue: throw py::value_error(s.message);
    case gdn::StatusKind::kCudaError: throw std::runtime_error(s.message);
  }
  throw std::runtime_error("unknown status kind: " + s.message);
}

// The parsed arguments of one call: the kernel's parameter struct plus where to launch.
template <typename P>
struct Call {
  P p;
  int device = 0;
  std::uintptr_t stream = 0;
};

[[noreturn]] void wrong_type(const std::string& fn, const char* name, const char* want, py::handle h) {
  throw py::type_error(fn + "(): argument '" + name + "' must be " + want + ", got " +
                       Py_TYPE(h.ptr())->tp_name);
}

bool is_int(py::handle h) { return PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr()); }

// Python value -> C++ field, by the field's type; a pointer (std::uintptr_t) also takes None.
template <typename T>
T cast_arg(py::handle h, const std::string& fn, const char* name);

template <>
std::uintptr_t cast_arg<std::uintptr_t>(py::handle h, const std::string& fn, const char* name) {
  if (h.is_none()) return 0;
  if (!is_int(h)) wrong_type(fn, name, "a pointer (int) or None", h);
  try {
    return h.cast<std::uintptr_t>();
  } catch (const py::cast_error&) {
    throw py::type_error(fn + "(): argument '" + name + "' = " + std::string(py::repr(h)) +
                         " is not a pointer (an unsigned 64-bit int)");
  }
}

template <>
int64_t cast_arg<int64_t>(py::handle h, const std::string& fn, const char* name) {
  if (!is_int(h)) wrong_type(fn, name, "an int", h);
  try {
    return h.cast<int64_t>();
  } catch (const py::cast_error&) {
    throw py::type_error(fn + "(): argument '" + name + "' = " + std::string(py::repr(h)) +
                         " does not fit int64");
  }
}

template <>
int cast_arg<int>(py::handle h, const std::string& fn, const char* name) {
  const int64_t v = cast_arg<int64_t>(h, fn, name);
  if (v < INT32_MIN || v > INT32_MAX)
    throw py::type_error(fn + "(): argument '" + name + "' = " + std::to_string(v) + " does not fit int32");
  return static_cast<int>(v);
}

template <>
float cast_arg<float>(py::handle h, const std::string& fn, const char* name) {
  if (!is_int(h) && !PyFloat_Check(h.ptr())) wrong_type(fn, name, "a float", h);
  return h.cast<float>();
}

template <>
bool cast_arg<bool>(py::handle h, const std::string& fn, const char* name) {
  if (!PyBool_Check(h.ptr())) wrong_type(fn, name, "a bool", h);
  return h.cast<bool>();
}

// One declared keyword argument: its name, how it is stored into a Call<P> and, for a required
// pointer, whether the parsed call leaves it null although the kernel would read or write through it.
template <typename P>
struct Arg {
  const char* name;
  std::function<void(Call<P>&, py::handle, const std::string&)> set;
  std::function<bool(const P&)> null_but_used = nullptr;
};

// A scalar, or an optional pointer (None -> null: "no such tensor").
template <typename P, typename M>
Arg<P> arg(const char* name, M P::*member) {
  return {name, [name, member](Call<P>& c, py::handle h, const std::string& fn) {
            c.p.*member = cast_arg<M>(h, fn, name);
          }};
}

// A required pointer: null (None or 0) is a ValueError naming it whenever `used(p)` says the kernel
// touches the tensor, i.e. it has elements (an empty tensor may have a null data pointer).
template <typename P, typename Used>
Arg<P> ptr(const char* name, std::uintptr_t P::*member, Used used) {
  Arg<P> a = arg(name, member);
  a.null_but_used = [member, used](const P& p) { return p.*member == 0 && used(p); };
  return a;
}

// `used` of a pointer the kernel always touches (cu_seqlens: N + 1 >= 1 elements).
template <typename P>
bool always(const P&) { return true; }

// The declared list plus `device` and `stream` (the device launch; the host mirror takes neither).
template <typename P>
std::vector<Arg<P>> with_stream(std::vector<Arg<P>> args) {
  args.push_back({"device", [](Call<P>& c, py::handle h, const std::string& fn) {
                    c.device = cast_arg<int>(h, fn, "device");
                  }});
  args.push_back({"stream", [](Call<P>& c, py::handle h, const std::string& fn) {
                    c.stream = cast_arg<std::uintptr_t>(h, fn, "stream");
                  }});
  return args;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out;
}

template <typename P>
Call<P> parse(const std::string& fn, const std::vector<Arg<P>>& args, const py::args& pos,
              const py::kwargs& kw) {
  if (pos.size() != 0)
    throw py::type_error(fn + "() takes keyword arguments only, got " + std::to_string(pos.size()) +
                         " positional");
  std::vector<std::string> unknown, missing;
  for (auto item : kw) {
    const std::string name = py::str(item.first);
    bool known = false;
    for (const auto& a : args) known = known || name == a.name;
    if (!known) unknown.push_back(name);
  }
  if (!unknown.empty())
    throw py::type_error(fn + "() got unexpected keyword argument" + (unknown.size() > 1 ? "s " : " ") +
                         quoted_list(unknown));
  for (const auto& a : args)
    if (!kw.contains(a.name)) missing.push_back(a.name);
  if (!missing.empty())
    throw py::type_error(fn + "() missing required keyword argument" + (missing.size() > 1 ? "s " : " ") +
                         quoted_list(missing) + " (pass None for an absent optional pointer)");
  Call<P> c;
  for (const auto& a : args) a.set(c, kw[a.name], fn);
  for (const auto& a : args)
    if (a.null_but_used && a.null_but_used(c.p))
      throw py::value_error(fn + "(): argument '" + a.name + "' is a null pointer (None) but the kernel "
                            "reads or writes it (pass the tensor's data_ptr())");
  return c;
}

template <typename P>
std::string signature(const std::string& fn, const std::vector<Arg<P>>& args) {
  std::string s = fn + "(*";
  for (const auto& a : args) s += std::string(", ") + a.name;
  return s + ")\n\n";
}

// Binds `name` (device launch on `stream` of `device`) and `name`_host (the host mirror: the same
// per-thread bodies over the whole grid in a CPU loop, host pointers) from one declared list.
template <typename P, typename Run>
void def_kernel(py::module_& m, const std::string& name, const std::vector<Arg<P>>& args, Run run,
                const std::string& doc) {
  const std::vector<Arg<P>> dev_args = with_stream(args);
  m.def(name.c_str(),
        [name, dev_args, run](py::args pos, py::kwargs kw) {
          const Call<P> c = parse(name, dev_args, pos, kw);
          gdn::Status st;
          {
            py::gil_scoped_release nogil;
            st = run(c.p, false, c.device, c.stream);
          }
          raise_if(st);
        },
        (signature(name, dev_args) + doc + " Asynchronous on `stream` of `device`.").c_str());
  const std::string host_name = name + "_host";
  m.def(host_name.c_str(),
        [host_name, args, run](py::args pos, py::kwargs kw) {
          const Call<P> c = parse(host_name, args, pos, kw);
          gdn::Status st;
          {
            py::gil_scoped_release nogil;
            st = run(c.p, true, 0, 0);
          }
          raise_if(st);
        },
        (signature(host_name, args) + doc +
         " Host mirror: the same per-thread bodies over the whole grid in a CPU loop (host pointers).")
            .c_str());
}

// ---- the declared argument lists ----------------------------------------------------------------
using gdn::ChunkTableParams;
using gdn::ConvParams;
using gdn::RecurrentParams;

std::vector<Arg<ChunkTableParams>> chunk_table_args() {
  using P = ChunkTableParams;
  auto slots = [](const P& p) { return p.chunk_size > 0 && p.T / p.chunk_size + p.N > 0; };
  return {ptr("cu_seqlens", &P::cu_seqlens, always<P>), arg("cu_seqlens_padded", &P::cu_seqlens_padded),
          arg("index_int64", &P::index_int64), arg("N", &P::N), arg("T", &P::T),
          arg("chunk_size", &P::chunk_size), ptr("table", &P::table, slots),
          ptr("cu_chunks", &P::cu_chunks, always<P>)};
}

std::vector<Arg<ConvParams>> conv_args(bool bwd) {
  using P = ConvParams;
  auto rows = [](const P& p) { return p.T > 0 && p.D > 0; };
  auto states = [](const P& p) { return p.N > 0 && p.D > 0 && p.W > 1; };
  auto channels = [](const P& p) { return p.D > 0 && p.W > 0; };
  std::vector<Arg<P>> a = {
      ptr("x", &P::x, rows), ptr("weight", &P::weight, channels), arg("bias", &P::bias),
      arg("initial_state", &P::initial_state), ptr("cu_seqlens", &P::cu_seqlens, always<P>),
      arg("cu_seqlens_padded", &P::cu_seqlens_padded), arg("N", &P::N), arg("T", &P::T), arg("D", &P::D),
      arg("W", &P::W), arg("dtype", &P::dtype), arg("silu", &P::silu), arg("tile_rows", &P::tile_rows)};
  if (bwd) {
    for (auto x : {ptr("dy", &P::dy, rows), arg("dfinal", &P::dfinal), ptr("dx", &P::dx, rows),
                   ptr("partial", &P::partial, rows), ptr("dweight_bias", &P::dweight_bias, channels),
                   ptr("dinitial_state", &P::dinitial_state, states)})
      a.push_back(x);
  } else {
    a.push_back(ptr("y", &P::y, rows));
    a.push_back(ptr("final_state", &P::final_state, states));
  }
  return a;
}

std::vector<Arg<RecurrentParams>> recurrent_args() {
  using P = RecurrentParams;
  auto qk = [](const P& p) { return p.T > 0 && p.H > 0 && p.K > 0; };
  auto vo = [](const P& p) { return p.T > 0 && p.HV > 0 && p.V > 0; };
  auto gates = [](const P& p) { return p.T > 0 && p.HV > 0; };
  return {ptr("q", &P::q, qk), ptr("k", &P::k, qk), ptr("v", &P::v, vo), ptr("g", &P::g, gates),
          ptr("beta", &P::beta, gates), ptr("cu_seqlens", &P::cu_seqlens, always<P>),
          arg("cu_seqlens_padded", &P::cu_seqlens_padded),
          arg("initial_state", &P::initial_state), arg("final_state", &P::final_state),
          arg("state_indices", &P::state_indices), arg("pool_size", &P::pool_size),
          arg("slot_roles", &P::slot_roles), ptr("o", &P::o, vo), arg("N", &P::N), arg("T", &P::T), arg("H", &P::H),
          arg("HV", &P::HV), arg("K", &P::K), arg("V", &P::V), arg("dtype", &P::dtype), arg("scale", &P::scale),
          arg("l2norm", &P::l2norm)};
}

#if defined(GDN_HAVE_SM90)
std::vector<Arg<gdn::ChunkSm90Params>> chunk_sm90_args() {
  using P = gdn::ChunkSm90Params;
  auto qk = [](const P& p) { return p.T > 0 && p.H > 0; };
  auto vo = [](const P& p) { return p.T > 0 && p.HV > 0; };
  auto raw = [](const P& p) { return p.raw_gates && p.HV > 0; };
  return {ptr("q", &P::q, qk), ptr("k", &P::k, qk), ptr("v", &P::v, vo), ptr("g", &P::g, vo),
          ptr("beta", &P::beta, vo), ptr("A_log", &P::A_log, raw), ptr("dt_bias", &P::dt_bias, raw),
          ptr("table", &P::table, always<P>), ptr("cu_chunks", &P::cu_chunks, always<P>),
          arg("initial_state", &P::initial_state), arg("final_state", &P::final_state), ptr("o", &P::o, vo),
          arg("kept_gates", &P::kept_gates), arg("kept_eg_last", &P::kept_eg_last), arg("kept_rn", &P::kept_rn),
          arg("kept_ts", &P::kept_ts), arg("kept_mm", &P::kept_mm), arg("kept_entering", &P::kept_entering),
          arg("kept_segments", &P::kept_segments), arg("prep_gates", &P::prep_gates),
          arg("prep_eg_last", &P::prep_eg_last), arg("prep_ts", &P::prep_ts), arg("prep_mm", &P::prep_mm),
          arg("NC", &P::NC), arg("N", &P::N), arg("T", &P::T),
          arg("H", &P::H), arg("HV", &P::HV), arg("K", &P::K), arg("V", &P::V), arg("chunk_size", &P::chunk_size),
          arg("dtype", &P::dtype), arg("scale", &P::scale), arg("l2norm", &P::l2norm),
          arg("raw_gates", &P::raw_gates), arg("split", &P::split),
          arg("pairs", &P::pairs)};
}

std::vector<Arg<gdn::ChunkBwdSm90Params>> chunk_bwd_sm90_args() {
  using P = gdn::ChunkBwdSm90Params;
  auto qk = [](const P& p) { return p.T > 0 && p.H > 0; };
  auto vo = [](const P& p) { return p.T > 0 && p.HV > 0; };
  auto slots = [](const P& p) { return p.NC > 0 && p.HV > 0; };
  auto seqs = [](const P& p) { return p.N > 0 && p.HV > 0; };
  return {ptr("q", &P::q, qk), ptr("k", &P::k, qk), ptr("do", &P::do_, vo), ptr("gates", &P::gates, slots),
          ptr("eg_last", &P::eg_last, slots), ptr("ts", &P::ts, slots), ptr("mm", &P::mm, slots),
          ptr("table", &P::table, always<P>), ptr("cu_chunks", &P::cu_chunks, always<P>), arg("dht", &P::dht),
          ptr("dsn", &P::dsn, slots), ptr("dxp", &P::dxp, slots), ptr("dv", &P::dv, vo), ptr("dh0", &P::dh0, seqs),
          ptr("dq", &P::dq, qk), ptr("dk", &P::dk, qk), ptr("dg", &P::dg, vo), ptr("dbeta", &P::dbeta, vo),
          arg("N", &P::N), arg("T", &P::T), arg("H", &P::H), arg("HV", &P::HV), arg("K", &P::K), arg("V", &P::V),
          arg("NC", &P::NC), arg("chunk_size", &P::chunk_size), arg("dtype", &P::dtype),
          arg("gate_dtype", &P::gate_dtype), arg("pairs", &P::pairs)};
}

std::vector<Arg<gdn::ChunkGradsSm90Params>> chunk_grads_sm90_args() {
  using P = gdn::ChunkGradsSm90Params;
  auto qk = [](const P& p) { return p.T > 0 && p.H > 0; };
  auto vo = [](const P& p) { return p.T > 0 && p.HV > 0; };
  auto slots = [](const P& p) { return p.NC > 0 && p.HV > 0; };
  return {ptr("q", &P::q, qk), ptr("k", &P::k, qk), ptr("v", &P::v, vo), ptr("do", &P::do_, vo),
          ptr("g", &P::g, vo), ptr("gates", &P::gates, slots), ptr("eg_last", &P::eg_last, slots),
          ptr("rn", &P::rn, slots), ptr("st", &P::st, slots), ptr("ut", &P::ut, slots), ptr("dsn", &P::dsn, slots),
          ptr("dxp", &P::dxp, slots), ptr("table", &P::table, always<P>), ptr("dq", &P::dq, qk),
          ptr("dk", &P::dk, qk), ptr("dg_part", &P::dg_part, vo), ptr("dbeta_part", &P::dbeta_part, vo),
          arg("N", &P::N), arg("T", &P::T), arg("H", &P::H), arg("HV", &P::HV), arg("K", &P::K), arg("V", &P::V),
          arg("NC", &P::NC), arg("chunk_size", &P::chunk_size), arg("dtype", &P::dtype), arg("scale", &P::scale),
          arg("dqk_f32", &P::dqk_f32)};
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gdn_packed CUDA kernels (raw-pointer interface, CUDA runtime linked statically)";

  m.def("cuda_runtime_version", &gdn::cuda_runtime_version,
        "CUDA runtime version of the statically linked cudart, e.g. 13000");
  m.def("cuda_compiled_version", &gdn::cuda_compiled_version, "CUDART_VERSION at build time");
  m.def("cuda_driver_version", []() { return gdn::cuda_driver_version(nullptr); },
        "CUDA driver version, 0 when no driver is installed");
  m.def("device_count", []() { return gdn::cuda_device_count(nullptr); },
        "Number of visible CUDA devices; 0 when there is no driver or no device");
  m.def("cuda_status", []() {
          std::string derr, cerr;
          py::dict d;
          d["runtime_version"] = gdn::cuda_runtime_version();
          d["compiled_version"] = gdn::cuda_compiled_version();
          d["driver_version"] = gdn::cuda_driver_version(&derr);
          d["device_count"] = gdn::cuda_device_count(&cerr);
          d["error"] = cerr.empty() ? derr : cerr;
          d["archs"] = std::string(GDN_CUDA_ARCHS);
          return d;
        },
        "dict(runtime_version, compiled_version, driver_version, device_count, error, archs); "
        "error is '' when a device is usable, else the CUDA error (e.g. cudaErrorInsufficientDriver)");
  m.attr("cuda_archs") = std::string(GDN_CUDA_ARCHS);

  def_kernel(m, "chunk_table", chunk_table_args(), &gdn::chunk_table,
             "Build the chunk table (gdn_packed/torch_ref/chunk_table.py): table int32 "
             "[T // chunk_size + N, 4], cu_chunks int32 [N+1].");
  def_kernel(m, "conv1d_varlen_fwd", conv_args(false),
             [](const ConvParams& p, bool host, int dev, std::uintptr_t s) {
               return gdn::conv1d_varlen(p, false, host, dev, s);
             },
             "Varlen causal conv1d forward (gdn_packed/cuda/conv1d.py).");
  def_kernel(m, "conv1d_varlen_bwd", conv_args(true),
             [](const ConvParams& p, bool host, int dev, std::uintptr_t s) {
               return gdn::conv1d_varlen(p, true, host, dev, s);
             },
             "Varlen causal conv1d backward (gdn_packed/cuda/conv1d.py).");
  def_kernel(m, "recurrent_gdr_fwd", recurrent_args(), &gdn::recurrent_gdr,
             "Recurrent gated delta rule forward (gdn_packed/cuda/recurrent.py).");
  // the sm_90a kernels' barrier watchdog (a debug build: GDN_PACKED_SM90_WATCHDOG, setup.py): its spin count, 0 off
  m.attr("sm90_watchdog") = static_cast<int64_t>(GDN_SM90_WATCHDOG_SPINS);
#if defined(GDN_HAVE_SM90)
  // the arrivals that publish a prep buffer of the sm_90a forward (128 with GDN_PACKED_SM90_PREP_ARRIVALS=1,
  // setup.py; else 1)
  m.attr("sm90_prep_arrivals") = gdn::chunk_gdr_fwd_sm90_prep_arrivals();
  m.attr("chunk_gdr_fwd_sm90_missing") = std::string();
  m.attr("chunk_gdr_fwd_sm90_smem_bytes") = gdn::chunk_gdr_fwd_sm90_smem_bytes();
  m.def("chunk_gdr_fwd_sm90_split_clusters", &gdn::chunk_gdr_fwd_sm90_split_clusters, pybind11::arg("device"),
        pybind11::arg("pairs"),
        "The split forward kernel's clusters (of 4; pairs: of 8, on GVA pairs of value heads) that can be "
        "resident at once on a CUDA device (GPC placement), or -1 where the runtime cannot say.");
  def_kernel(m, "chunk_gdr_fwd_sm90", chunk_sm90_args(), &gdn::chunk_gdr_fwd_sm90,
             "Chunked gated delta rule forward, sm_90a, K = V = 128 (gdn_packed/cuda/chunk.py).");
  m.attr("chunk_gdr_bwd_sm90_smem_bytes") = gdn::chunk_gdr_bwd_sm90_smem_bytes();
  def_kernel(m, "chunk_gdr_bwd_sm90", chunk_bwd_sm90_args(), &gdn::chunk_gdr_bwd_sm90,
             "Chunked gated delta rule backward's reverse dS pass, sm_90a, K = V = 128, on Triton prep's "
             "outputs (gdn_packed/cuda/chunk.py).");
  m.attr("chunk_gdr_grads_sm90_smem_bytes") = gdn::chunk_gdr_grads_sm90_smem_bytes();
  def_kernel(m, "chunk_gdr_grads_sm90", chunk_grads_sm90_args(), &gdn::chunk_gdr_grads_sm90,
             "Chunked gated delta rule backward's chunk-parallel gradients (dq, dk, the dg / dbeta shares), "
             "sm_90a, K = V = 128 (gdn_packed/cuda/chunk.py).");
#else
  m.attr("chunk_gdr_fwd_sm90_missing") = std::string(GDN_NO_SM90_WHY);   // why _C has no sm_90a chunked kernel
#endif
}
