# headmix::mpi: the layers sharded over MPI processes (include/headmix/mpi/),
# an optional part that the core headmix::headmix target never depends on.
#
# headmix calls MPI's C API. FindMPI's C component needs the C language,
# which this C++-only project does not enable, so the CXX component is asked
# for with its C++ bindings skipped: that is the C library and mpi.h, with
# OMPI_SKIP_MPICXX / MPICH_SKIP_MPICXX defined.
set(MPI_CXX_SKIP_MPICXX ON)
find_package(MPI COMPONENTS CXX QUIET)
if(MPI_CXX_FOUND)
  add_library(headmix_mpi INTERFACE)
  add_library(headmix::mpi ALIAS headmix_mpi)
  target_link_libraries(headmix_mpi INTERFACE headmix::headmix MPI::MPI_CXX)
  set_target_properties(headmix_mpi PROPERTIES EXPORT_NAME mpi)  # installed as headmix::mpi too
else()
  message(STATUS "headmix::mpi: MPI not found (install libopenmpi-dev openmpi-bin); "
                 "the MPI layers and their tests are skipped")
endif()
