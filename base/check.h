// Copyright kvferry authors. Apache-2.0.
#pragma once
// Internal error-propagation macros. Inside kvferry every fallible function returns Status or
// Result<T>; these return early with the error. They are public (kvferry/status_macros.h) so
// that engines and the examples propagate kvferry's errors the same way.

#include "kvferry/status_macros.h"
