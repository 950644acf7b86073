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
  if (err.rfind("chunk_table: ", 0) == 0) throw std::runtime_error(err);
  throw py::value_error(err);
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
