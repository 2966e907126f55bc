// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file kvferry.h
/// \brief Umbrella header.
#include "kvferry/config.h"
#include "kvferry/kv_pages.h"
#include "kvferry/policy.h"
#include "kvferry/runtime.h"
#include "kvferry/stats.h"
#include "kvferry/status.h"
#include "kvferry/status_macros.h"
#include "kvferry/tensor.h"
