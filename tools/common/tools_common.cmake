# The command-line code every tool shares (tools/common/args.h: one argument parser, the CUDA
# device probe; tools/common/progress.h). Included by examples/, bench/ and tests/ (whichever
# comes first defines the target), so that neither depends on the other.
if(NOT TARGET kvferry_tools_common)
  add_library(kvferry_tools_common STATIC ${CMAKE_CURRENT_LIST_DIR}/args.cpp)
  target_include_directories(kvferry_tools_common PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(kvferry_tools_common PUBLIC ${CMAKE_DL_LIBS})
  target_compile_options(kvferry_tools_common PRIVATE -Wall -Wextra)
endif()
