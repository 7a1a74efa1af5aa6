# Probe (issue 23): which libstdc++ the GPU machine's g++ links into a shared library.
g++ -print-file-name=libstdc++.so; g++ -print-file-name=libstdc++.a
ls -la $(dirname $(g++ -print-file-name=libstdc++.a))/libstdc++* 2>&1
for so in ~/.cache/torch_extensions/*/probe_throw_inline*/*.so; do echo "$so: $(nm -C $so | grep -c ' [TW] std::ostream& std::ostream::_M_insert<long>') defined _M_insert<long>; $(ldd $so | grep -c libstdc) libstdc++ in ldd"; done
