include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(DIRECTORY include/headmix DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS headmix EXPORT headmixTargets)
set(HEADMIX_CMAKE_DIR ${CMAKE_INSTALL_DATADIR}/cmake/headmix)
install(EXPORT headmixTargets NAMESPACE headmix:: DESTINATION ${HEADMIX_CMAKE_DIR})
# headmix::io, when built with nlohmann/json: its own export set, which the
# package config loads only where nlohmann/json is found.
if(TARGET headmix_io)
  install(TARGETS headmix_io EXPORT headmixIoTargets)
  install(EXPORT headmixIoTargets NAMESPACE headmix:: DESTINATION ${HEADMIX_CMAKE_DIR})
endif()
# headmix::mpi, when built with MPI: an export set of its own, which the
# package config loads (finding MPI) only where it was installed.
if(TARGET headmix_mpi)
  install(TARGETS headmix_mpi EXPORT headmixMpiTargets)
  install(EXPORT headmixMpiTargets NAMESPACE headmix:: DESTINATION ${HEADMIX_CMAKE_DIR})
endif()

configure_package_config_file(cmake/headmixConfig.cmake.in ${PROJECT_BINARY_DIR}/headmixConfig.cmake
  INSTALL_DESTINATION ${HEADMIX_CMAKE_DIR})
# Header-only and architecture-independent.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/headmixConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/headmixConfig.cmake ${PROJECT_BINARY_DIR}/headmixConfigVersion.cmake
  cmake/HeadmixDependencies.cmake DESTINATION ${HEADMIX_CMAKE_DIR})
