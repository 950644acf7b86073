// pybind11 module gdn_packed._C. No libtorch: the Python ops pass raw device pointers (Python ints),
// sizes and the cudaStream_t of torch's current stream (torch.cuda.current_stream().cuda_stream).
// Errors come back as RuntimeError (CUDA errors, with cudaGetErrorString) or ValueError (sizes).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "api.h"

namespace py = pybind11;

#ifndef GDN_CUDA_ARCHS
#define GDN_CUDA_ARCHS "unknown"
#endif

namespace {

void raise_if(const std::string& err) {
  if (err.empty()) return;
  if (err.rfind("chunk_table: ", 0) == 0 || err.find("cudaError") != std::string::npos)
    throw std::runtime_error(err);
  throw py::value_error(err);
}

gdn::ConvParams conv_params(py::kwargs kw) {
  gdn::ConvParams p;
  auto ptr = [&](const char* name, std::uintptr_t* dst) {
    if (kw.contains(name)) *dst = kw[name].cast<std::uintptr_t>();
  };
  ptr("x", &p.x); ptr("weight", &p.weight); ptr("bias", &p.bias); ptr("initial_state", &p.initial_state);
  ptr("cu_seqlens", &p.cu_seqlens); ptr("cu_seqlens_padded", &p.cu_seqlens_padded);
  ptr("y", &p.y); ptr("final_state", &p.final_state); ptr("dy", &p.dy); ptr("dfinal", &p.dfinal);
  ptr("dx", &p.dx); ptr("partial", &p.partial); ptr("dweight_bias", &p.dweight_bias);
  ptr("dinitial_state", &p.dinitial_state);
  p.N = kw["N"].cast<int64_t>();
  p.T = kw["T"].cast<int64_t>();
  p.D = kw["D"].cast<int64_t>();
  p.W = kw["W"].cast<int>();
  p.dtype = kw["dtype"].cast<int>();
  p.silu = kw["silu"].cast<bool>();
  p.tile_rows = kw["tile_rows"].cast<int64_t>();
  return p;
}

gdn::RecurrentParams recurrent_params(py::kwargs kw) {
  gdn::RecurrentParams p;
  auto ptr = [&](const char* name, std::uintptr_t* dst) {
    if (kw.contains(name)) *dst = kw[name].cast<std::uintptr_t>();
  };
  ptr("q", &p.q); ptr("k", &p.k); ptr("v", &p.v); ptr("g", &p.g); ptr("beta", &p.beta);
  ptr("cu_seqlens", &p.cu_seqlens); ptr("cu_seqlens_padded", &p.cu_seqlens_padded);
  ptr("initial_state", &p.initial_state); ptr("final_state", &p.final_state);
  ptr("state_indices", &p.state_indices); ptr("slot_roles", &p.slot_roles); ptr("o", &p.o);
  p.N = kw["N"].cast<int64_t>();
  p.T = kw["T"].cast<int64_t>();
  p.H = kw["H"].cast<int64_t>();
  p.HV = kw["HV"].cast<int64_t>();
  p.K = kw["K"].cast<int64_t>();
  p.V = kw["V"].cast<int64_t>();
  p.dtype = kw["dtype"].cast<int>();
  p.scale = kw["scale"].cast<float>();
  p.l2norm = kw["l2norm"].cast<bool>();
  if (kw.contains("pool_size")) p.pool_size = kw["pool_size"].cast<int64_t>();
  return p;
}

// Device launch: the kwargs plus device= and stream=; host mirror: the kwargs only.
template <typename P, typename F>
void def_kernel(py::module_& m, const char* name, P (*params)(py::kwargs), F run, const char* doc) {
  m.def(name, [params, run](py::kwargs kw) {
          const int device = kw["device"].cast<int>();
          const auto stream = kw["stream"].cast<std::uintptr_t>();
          kw.attr("pop")("device");
          kw.attr("pop")("stream");
          const P p = params(kw);
          std::string err;
          {
            py::gil_scoped_release nogil;
            err = run(p, false, device, stream);
          }
          raise_if(err);
        }, doc);
  m.def((std::string(name) + "_host").c_str(), [params, run](py::kwargs kw) {
          const P p = params(kw);
          std::string err;
          {
            py::gil_scoped_release nogil;
            err = run(p, true, 0, 0);
          }
          raise_if(err);
        }, (std::string(doc) + " Host mirror: the same per-thread bodies over the whole grid in a CPU "
            "loop (host pointers).").c_str());
}

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

  m.def("chunk_table",
        [](std::uintptr_t cu_seqlens, std::uintptr_t cu_seqlens_padded, bool index_int64, int64_t N,
           int64_t T, int64_t chunk_size, std::uintptr_t table, std::uintptr_t cu_chunks, int device,
           std::uintptr_t stream) {
          std::string err;
          {
            py::gil_scoped_release nogil;
            err = gdn::chunk_table_cuda(cu_seqlens, cu_seqlens_padded, index_int64, N, T, chunk_size,
                                        table, cu_chunks, device, stream);
          }
          raise_if(err);
        },
        py::arg("cu_seqlens"), py::arg("cu_seqlens_padded"), py::arg("index_int64"), py::arg("N"),
        py::arg("T"), py::arg("chunk_size"), py::arg("table"), py::arg("cu_chunks"),
        py::arg("device"), py::arg("stream"),
        "Build the chunk table on the GPU (device pointers as ints; cu_seqlens_padded=0 means None). "
        "table: int32 [T//chunk_size+N, 4], cu_chunks: int32 [N+1]. Asynchronous on `stream`.");

  def_kernel(m, "conv1d_varlen_fwd", &conv_params,
             [](const gdn::ConvParams& p, bool host, int dev, std::uintptr_t s) {
               return gdn::conv1d_varlen(p, false, host, dev, s);
             },
             "Varlen causal conv1d forward (keyword arguments: see gdn_packed/ops/conv1d.py).");
  def_kernel(m, "conv1d_varlen_bwd", &conv_params,
             [](const gdn::ConvParams& p, bool host, int dev, std::uintptr_t s) {
               return gdn::conv1d_varlen(p, true, host, dev, s);
             },
             "Varlen causal conv1d backward (keyword arguments: see gdn_packed/ops/conv1d.py).");
  def_kernel(m, "recurrent_gdr_fwd", &recurrent_params,
             [](const gdn::RecurrentParams& p, bool host, int dev, std::uintptr_t s) {
               return gdn::recurrent_gdr(p, host, dev, s);
             },
             "Recurrent gated delta rule forward (keyword arguments: see gdn_packed/ops/recurrent_gdr.py).");

  m.def("chunk_table_host",
        [](std::uintptr_t cu_seqlens, std::uintptr_t cu_seqlens_padded, bool index_int64, int64_t N,
           int64_t T, int64_t chunk_size, std::uintptr_t table, std::uintptr_t cu_chunks) {
          std::string err;
          {
            py::gil_scoped_release nogil;
            err = gdn::chunk_table_host(cu_seqlens, cu_seqlens_padded, index_int64, N, T, chunk_size,
                                        table, cu_chunks);
          }
          raise_if(err);
        },
        py::arg("cu_seqlens"), py::arg("cu_seqlens_padded"), py::arg("index_int64"), py::arg("N"),
        py::arg("T"), py::arg("chunk_size"), py::arg("table"), py::arg("cu_chunks"),
        "Run the same __host__ __device__ chunk-table bodies over the whole grid on the CPU "
        "(host pointers as ints).");
}
